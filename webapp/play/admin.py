"""Games in the admin: who played whom, how it ended; the game itself read-only."""

from django.contrib import admin

from webapp.play.models import Game


@admin.register(Game)
class GameAdmin(admin.ModelAdmin):
    list_display = ("id", "owner", "player_name", "model_mark", "status", "outcome", "created")
    list_filter = ("status", "outcome", "owner")
    search_fields = ("id", "player", "player_name")
    raw_id_fields = ("model",)
    readonly_fields = ("session", "replies", "task_id", "created", "updated", "finished")
