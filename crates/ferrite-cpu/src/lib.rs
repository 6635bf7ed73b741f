//! placeholder: filled in by its owner this session
