"""The router's link to the control plane: its view of the fleet (Follow), its session (reservations, queries) and its in-flight requests."""
