"""ASGI entry point: `uvicorn webapp.asgi:application`.

HTTP goes to Django (wrapped so uvicorn serves the static files, Plotly.js included,
without a separate web server); websockets go through Django's session authentication to
the Channels consumers of the jobs app (and the Play app once it is installed).
"""

import importlib
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
# Django must be set up before anything imports models (the consumers do).
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from webapp.jobs.routing import websocket_urlpatterns  # noqa: E402

websocket_routes = list(websocket_urlpatterns)
if settings.PLAY_ENABLED and importlib.util.find_spec("webapp.play.routing") is not None:
    websocket_routes += importlib.import_module("webapp.play.routing").websocket_urlpatterns

application = ProtocolTypeRouter(
    {
        "http": ASGIStaticFilesHandler(django_asgi_app),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_routes))),
    }
)
