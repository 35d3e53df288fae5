"""What both ends speak and agree on: messages, frames, the channel, the config, bucket layout."""
