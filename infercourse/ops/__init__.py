"""Operating inference services: checking what this machine and a running stack have
(`doctor`)."""
