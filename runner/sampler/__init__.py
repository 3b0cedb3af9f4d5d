"""The samplers: the embedded engine (engine/), the engine interface the rollout code drives
(engine_api.py), the SGLang-protocol HTTP server (server.py: the app and its routes; server_state.py: the
engine thread and the requests in flight; server_launch.py: under uvicorn; browser_guard.py; protocol.py and
protocol_response.py: requests in, responses out), the one async client that drives embedded and real SGLang
servers alike (client.py), the SGLang launcher (sglang_launch.py) and the mismatch measurement (mismatch.py).
Imports only the checkpoint room.
"""
