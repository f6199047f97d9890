"""The server's defaults for what one client may hold: body size, read time, idle time, connections.
(A module of constants, so `compress serve --help` states them without importing the server.)"""

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_KEEP_ALIVE_S = 5.0  # uvicorn's own
DEFAULT_MAX_CONNECTIONS = 1024
