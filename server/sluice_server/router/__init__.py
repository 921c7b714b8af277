"""The activator (`sluice-server activator`): holds requests for models scaled to zero
until a replica is ready, keeping their clients alive, then forwards them unchanged."""
