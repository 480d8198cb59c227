"""Data files shipped with rlcore (read through importlib.resources, never downloaded).

`paragraphs.txt`: one short English paragraph per line, written for this project, that the
reverse-text environment cuts excerpts from.
"""
