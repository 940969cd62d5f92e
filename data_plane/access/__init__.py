"""Who may use the router's APIs and how many at once: API keys and the concurrency limit, for every transport."""
