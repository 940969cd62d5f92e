"""The OpenAI API's shapes, for every transport: the routing fields of a request body and the error object."""
