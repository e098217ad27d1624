"""Kept for tools that still look for setup.py; everything is declared in pyproject.toml."""

from setuptools import setup

setup()
