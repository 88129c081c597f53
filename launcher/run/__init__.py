"""Running a job: the checks before launch, the launch commands, the supervisor, torchrun's
output."""
