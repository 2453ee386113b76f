"""Loaded at start-up by the processes ``bench.request_profile`` starts (this folder is
on their ``PYTHONPATH``): stage accounting, idle until SIGUSR1 (``bench.profile_stages``)."""

from bench.profile_stages import install

install()
