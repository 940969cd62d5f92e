"""Worker agent: one per engine; engine KV events -> kvroute block keys -> control plane."""
