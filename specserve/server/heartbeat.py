"""How the HTTP process tells a live engine from a stopped or wedged one (no imports: the server
reads these before anything heavy loads, server/engine_spawn.py)."""

HEARTBEAT_S = 1.0  # how often the engine process says it is alive
DEFAULT_STEP_TIMEOUT_S = 300.0  # one serving-loop iteration longer than this is a stuck engine
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0  # the engine beats every HEARTBEAT_S from a thread of its own
