from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "webapp.accounts"
    verbose_name = "Accounts"
