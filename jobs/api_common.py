"""What the jobs app's API views share besides their shapes (jobs.serializers): a whole-number
query parameter. An upload's troubles are answered by catalog.api_common."""

from rest_framework.exceptions import ValidationError


def int_param(request, name, default, minimum=0, maximum=None):
    value = request.query_params.get(name)
    if value in (None, ""):
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValidationError({name: [f"{value!r} is not a whole number."]}) from None
    if number < minimum or (maximum is not None and number > maximum):
        raise ValidationError({name: [f"must be between {minimum} and {maximum}."]})
    return number
