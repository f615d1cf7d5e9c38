"""The proxy in front of several api_servers (``lmdeploy serve proxy``), and ``api_server --dp N``."""
