"""Top-level URLs: the lab pages, the JSON API, accounts, the admin, and Play when present."""

import importlib.util

from django.conf import settings
from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("accounts/", include("webapp.accounts.urls")),
    path("api/", include("webapp.jobs.api_urls")),
    path("", include("webapp.jobs.urls")),
]

if settings.PLAY_ENABLED and importlib.util.find_spec("webapp.play.urls") is not None:
    urlpatterns.insert(0, path("play/", include("webapp.play.urls")))
