"""`specdecode serve`: an OpenAI-compatible HTTP server over the speculative engine."""

# Routes an API key can leave open, by group (light here: the command line lists them in its help). Health
# probes and Prometheus scrapers usually carry no key; as in vLLM, by default the key guards /v1 only.
# The live view's page is public (it holds no data and asks for the key itself); its calls go to /v1.
ROUTE_GROUPS = {"health": ("/health",), "metrics": ("/metrics",),
                "docs": ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"),
                "view": ("/", "/view/app.js", "/view/style.css")}
DEFAULT_PUBLIC_ROUTES = ("health", "metrics", "docs", "view")
