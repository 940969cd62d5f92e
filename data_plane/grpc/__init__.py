"""The gRPC `kvroute.v1.Router` transport: decisions that applications carry out themselves."""
