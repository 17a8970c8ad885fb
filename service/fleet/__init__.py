"""The fleet over Redis (--redis-url): the prefix registry, replica presence, the
warm-up, and this replica's part in it."""
