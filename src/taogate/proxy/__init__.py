"""The request pipeline: read and authenticate a request, forward it to an instance, relay the answer."""
