# Real Prefect, MLflow and S3 servers on loopback ports (session-scoped): tests/fixtures/servers.py
pytest_plugins = ["fixtures.servers"]
