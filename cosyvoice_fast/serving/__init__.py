"""What other programs talk to: the OpenAI-compatible HTTP and WebSocket API, metrics, the assembled service, Ray
Serve replicas and the remote client.
"""
