"""Template context every page needs: whether optional pages (Play) are installed."""

from django.conf import settings


def lab(request) -> dict:
    return {"play_enabled": settings.PLAY_ENABLED}
