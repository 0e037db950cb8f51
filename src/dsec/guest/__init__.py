"""The agent inside VMs (stdlib only). Containers use the native agent in dsec.agent."""
