"""`python manage.py ensure_admin`: make sure a first superuser exists (for `make run`).

The user is `admin`; its password comes from RLLAB_ADMIN_PASSWORD, or is generated and
printed once when the user is created. An existing admin is left as it is unless
RLLAB_ADMIN_PASSWORD is set, in which case the password is reset to it.
"""

import os
import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Create the superuser 'admin' if it does not exist (password: RLLAB_ADMIN_PASSWORD)."

    def add_arguments(self, parser):
        parser.add_argument("--username", default="admin")

    def handle(self, *args, username: str, **options):
        User = get_user_model()
        password = os.environ.get("RLLAB_ADMIN_PASSWORD")
        user = User.objects.filter(username=username).first()
        if user is not None:
            if password:
                user.set_password(password)
                user.is_staff = user.is_superuser = True
                user.save()
                self.stdout.write(
                    f"admin user {username!r}: password set from RLLAB_ADMIN_PASSWORD"
                )
            else:
                self.stdout.write(f"admin user {username!r} exists; left unchanged")
            return
        generated = not password
        password = password or secrets.token_urlsafe(12)
        User.objects.create_superuser(username=username, email="", password=password)
        if generated:
            self.stdout.write(f"created admin user {username!r} with password: {password}")
        else:
            self.stdout.write(
                f"created admin user {username!r} (password from RLLAB_ADMIN_PASSWORD)"
            )
