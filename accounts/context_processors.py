from accounts.access import team_of


def team(request):
    return {"team": team_of(getattr(request, "user", None))}
