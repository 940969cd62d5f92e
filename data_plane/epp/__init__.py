"""The Gateway API Inference Extension endpoint picker transport (`kvroute epp`)."""
