from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "webapp.jobs"
    verbose_name = "Lab: environments, models and jobs"
