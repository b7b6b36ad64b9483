"""The signed-in user of a browser's session, read with its membership and team in one query.

Every page and websocket of a signed-in user read its user (Django's ModelBackend.get_user),
then its membership with its team (accounts.access.membership_of, which the time zone
middleware and every team view ask for): two queries where one does, as the API's tokens have
theirs (accounts.authentication).
"""

from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend


class TeamModelBackend(ModelBackend):
    """Django's ModelBackend (the same passwords, permissions and inactive users), its
    session's user fetched with the membership and team every team page reads next."""

    def get_user(self, user_id):
        model = get_user_model()
        try:
            user = model._default_manager.select_related("membership__team").get(pk=user_id)
        except model.DoesNotExist:
            return None
        return user if self.user_can_authenticate(user) else None
