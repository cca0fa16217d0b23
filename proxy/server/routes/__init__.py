"""The server's routes, one router per concern; ``app.py`` includes them all."""

from foretell.proxy.server.routes import chat, completions, playground, status, tokens

ROUTERS = (playground.router, status.router, tokens.router, completions.router, chat.router)
# Every path served (the 404 answer suggests the one a caller most likely meant).
PATHS = frozenset(route.path for router in ROUTERS for route in router.routes)
