"""Websocket routes of the jobs app."""

from django.urls import path

from webapp.jobs.consumers import JobConsumer

websocket_urlpatterns = [
    path("ws/jobs/<int:job_id>/", JobConsumer.as_asgi()),
]
