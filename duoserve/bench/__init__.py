"""``duoserve bench``: a load client for any OpenAI-compatible server, and its report."""
