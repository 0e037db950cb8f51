"""The adversarial suite: per class of attack, several attacks a determined agent would
write, each asserting the verdict stays honest and an event names the attempt."""
