"""The front doors: the websocket protocol (kvchat's), the OpenAI-compatible HTTP API, and what both share
(placement of a stateless request, the connection's bounded sends, Host/Origin guards, the loading watch).

They call the turn core (daemon/turns.py) and know nothing of each other.
"""
