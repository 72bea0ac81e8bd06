"""Prefect flows (composition only) and the deployments that run them on events and schedules."""
