"""Operations: the router's metrics, stage timing and traffic capture."""
