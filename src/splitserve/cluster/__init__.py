"""Launchers that start a deployment: local processes now, Ray actors later."""
