"""ZeroMQ plumbing shared by every process of a deployment: the deployment key and CURVE
sockets (``auth``), and connection heartbeats (``heartbeat``).

A low layer: it imports only pyzmq and ``duoserve.errors``, so the KV connectors, the
engine process and the frontend all import it from above. Torch-free: the API process uses it.
"""
