"""What stands before a route: API keys and tenancy, body limits and deadlines,
connection caps, and the pacing of refusals."""
