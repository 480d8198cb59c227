#!/usr/bin/env python
"""Django's command-line entry point for the rllab web lab (migrate, ensure_admin, ...)."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
