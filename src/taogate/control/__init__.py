"""Background work that keeps the fleet picture current: probes, scrapes, warm-up, discovery."""
