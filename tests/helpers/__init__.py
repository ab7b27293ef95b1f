"""What several test modules share: helpers named by what they build or check (never imported from a test
module)."""
