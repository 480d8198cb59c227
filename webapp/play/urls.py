"""The Play pages and their JSON endpoints, mounted at /play/."""

from django.urls import path

from webapp.play import views

app_name = "play"

urlpatterns = [
    path("", views.home, name="home"),
    path("games/<int:pk>/", views.game_detail, name="game"),
    path("games/<int:pk>/move/", views.game_move, name="move"),
    path("games/<int:pk>/retry/", views.game_retry, name="retry"),
    path("history/", views.history, name="history"),
    path("history/<str:player>/", views.player_history, name="player_history"),
    path("api/games/", views.api_games, name="api_games"),
    path("api/games/<int:pk>/", views.api_game, name="api_game"),
    path("api/games/<int:pk>/move/", views.api_move, name="api_move"),
    path("api/games/<int:pk>/retry/", views.api_retry, name="api_retry"),
]
