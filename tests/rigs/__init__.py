"""What the tests share: onebitd's configs and runs, the fakes' control, HTTP and waiting helpers."""
