"""What the router knows of engines beside the control plane: engines found by DNS and their health."""
