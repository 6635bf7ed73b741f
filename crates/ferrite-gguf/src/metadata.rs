//! GGUF metadata: typed key/value pairs in file order, with typed getters that give clear errors.

use crate::error::GgufError;
use std::collections::HashMap;

/// One metadata value. GGUF arrays are homogeneous; `Array` holds the decoded elements.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// Any integer that is non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => v.try_into().ok(),
            Value::I16(v) => v.try_into().ok(),
            Value::I32(v) => v.try_into().ok(),
            Value::I64(v) => v.try_into().ok(),
            _ => None,
        }
    }

    /// Any integer that fits in an `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => v.try_into().ok(),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Any number (floats, and integers converted to the nearest `f64`).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The GGUF name of the value's type, as used in error messages ("u32", "string", "array"...).
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// Type name with the element type of arrays ("array of string"), for error messages.
    fn describe_type(&self) -> String {
        match self {
            Value::Array(items) => match items.first() {
                Some(first) => format!("array of {}", first.describe_type()),
                None => "empty array".to_string(),
            },
            other => other.type_name().to_string(),
        }
    }
}

/// Metadata entries in file order, with a key index.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an entry at the end, or replaces the value of an existing key in place.
    pub fn insert(&mut self, key: impl Into<String>, v: Value) {
        let key = key.into();
        match self.index.get(&key) {
            Some(&i) => self.entries[i].1 = v,
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, v));
            }
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// Entries in insertion (file) order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn required(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    /// A non-negative integer of any width.
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        value_u64(key, self.required(key)?)
    }

    pub fn u32(&self, key: &str) -> Result<u32, GgufError> {
        let v = self.u64(key)?;
        v.try_into().map_err(|_| out_of_range(key, v, "u32"))
    }

    /// Any number, converted to `f32`.
    pub fn f32(&self, key: &str) -> Result<f32, GgufError> {
        value_f32(key, self.required(key)?)
    }

    pub fn bool(&self, key: &str) -> Result<bool, GgufError> {
        let v = self.required(key)?;
        v.as_bool().ok_or_else(|| wrong_type(key, v, "a bool"))
    }

    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.required(key)?;
        v.as_str().ok_or_else(|| wrong_type(key, v, "a string"))
    }

    pub fn str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        const EXPECTED: &str = "an array of strings";
        let v = self.required(key)?;
        let items = v.as_array().ok_or_else(|| wrong_type(key, v, EXPECTED))?;
        items.iter().map(|item| item.as_str().ok_or_else(|| wrong_type(key, v, EXPECTED))).collect()
    }

    /// An array of numbers of any type, converted to `f32`.
    pub fn f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        const EXPECTED: &str = "an array of numbers";
        let v = self.required(key)?;
        let items = v.as_array().ok_or_else(|| wrong_type(key, v, EXPECTED))?;
        items
            .iter()
            .map(|item| item.as_f64().map(|x| x as f32).ok_or_else(|| wrong_type(key, v, EXPECTED)))
            .collect()
    }

    /// An array of integers of any type, each of which must fit in an `i32`.
    pub fn i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        const EXPECTED: &str = "an array of integers";
        let v = self.required(key)?;
        let items = v.as_array().ok_or_else(|| wrong_type(key, v, EXPECTED))?;
        items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let element = || format!("{key}[{i}]");
                match (item.as_i64(), item.as_u64()) {
                    (Some(x), _) => x.try_into().map_err(|_| out_of_range(&element(), x, "i32")),
                    (None, Some(too_big)) => Err(out_of_range(&element(), too_big, "i32")),
                    (None, None) => Err(wrong_type(key, v, EXPECTED)),
                }
            })
            .collect()
    }

    /// Like [`Metadata::u64`], but a missing key gives `default` (a present key of the wrong
    /// type is still an error).
    pub fn u64_or(&self, key: &str, default: u64) -> Result<u64, GgufError> {
        self.get(key).map_or(Ok(default), |v| value_u64(key, v))
    }

    /// Like [`Metadata::f32`], but a missing key gives `default`.
    pub fn f32_or(&self, key: &str, default: f32) -> Result<f32, GgufError> {
        self.get(key).map_or(Ok(default), |v| value_f32(key, v))
    }

    /// Like [`Metadata::bool`], but a missing key gives `default`.
    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool, GgufError> {
        if self.contains_key(key) {
            self.bool(key)
        } else {
            Ok(default)
        }
    }
}

fn value_u64(key: &str, v: &Value) -> Result<u64, GgufError> {
    match (v.as_u64(), v.as_i64()) {
        (Some(x), _) => Ok(x),
        (None, Some(negative)) => Err(out_of_range(key, negative, "u64")),
        (None, None) => Err(wrong_type(key, v, "an integer")),
    }
}

fn value_f32(key: &str, v: &Value) -> Result<f32, GgufError> {
    v.as_f64().map(|x| x as f32).ok_or_else(|| wrong_type(key, v, "a number"))
}

fn wrong_type(key: &str, v: &Value, expected: &'static str) -> GgufError {
    GgufError::WrongType { key: key.to_string(), found: v.describe_type(), expected }
}

fn out_of_range(key: &str, value: impl ToString, target: &'static str) -> GgufError {
    GgufError::OutOfRange { key: key.to_string(), value: value.to_string(), target }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Metadata {
        let mut m = Metadata::new();
        m.insert("general.architecture", Value::String("llama".into()));
        m.insert("llama.block_count", Value::U32(30));
        m.insert("neg", Value::I32(-3));
        m.insert("big", Value::U64(1 << 40));
        m.insert("eps", Value::F32(1e-5));
        m.insert("flag", Value::Bool(true));
        m.insert(
            "tokens",
            Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
        );
        m.insert("types", Value::Array(vec![Value::I32(1), Value::U8(6), Value::I64(-2)]));
        m.insert("scores", Value::Array(vec![Value::F32(0.5), Value::I32(-1)]));
        m.insert("huge", Value::Array(vec![Value::U64(1 << 33)]));
        m
    }

    #[test]
    fn insert_keeps_order_and_replaces_in_place() {
        let mut m = sample();
        let len = m.len();
        m.insert("llama.block_count", Value::U32(12));
        assert_eq!(m.len(), len);
        assert_eq!(m.u32("llama.block_count").unwrap(), 12);
        let keys: Vec<&str> = m.iter().map(|(k, _)| k).collect();
        assert_eq!(&keys[..3], &["general.architecture", "llama.block_count", "neg"]);
    }

    #[test]
    fn typed_getters() {
        let m = sample();
        assert_eq!(m.str("general.architecture").unwrap(), "llama");
        assert_eq!(m.u64("llama.block_count").unwrap(), 30);
        assert_eq!(m.f32("eps").unwrap(), 1e-5);
        assert_eq!(m.f32("llama.block_count").unwrap(), 30.0);
        assert!(m.bool("flag").unwrap());
        assert_eq!(m.str_array("tokens").unwrap(), vec!["a", "b"]);
        assert_eq!(m.i32_array("types").unwrap(), vec![1, 6, -2]);
        assert_eq!(m.f32_array("scores").unwrap(), vec![0.5, -1.0]);
        assert_eq!(m.u64_or("missing", 7).unwrap(), 7);
        assert_eq!(m.u64_or("big", 7).unwrap(), 1 << 40);
        assert_eq!(m.f32_or("missing", 2.5).unwrap(), 2.5);
        assert!(!m.bool_or("missing", false).unwrap());
        assert!(m.bool_or("flag", false).unwrap());
    }

    #[test]
    fn getter_errors_say_what_is_wrong() {
        let m = sample();
        assert_eq!(
            m.u64("llama.embedding_length").unwrap_err().to_string(),
            "metadata key `llama.embedding_length` is missing"
        );
        assert_eq!(
            m.u64("general.architecture").unwrap_err().to_string(),
            "metadata key `general.architecture` has type string, expected an integer"
        );
        assert_eq!(
            m.str_array("types").unwrap_err().to_string(),
            "metadata key `types` has type array of i32, expected an array of strings"
        );
        assert!(matches!(m.u32("big"), Err(GgufError::OutOfRange { .. })));
        assert!(matches!(m.u64("neg"), Err(GgufError::OutOfRange { .. })));
        assert!(matches!(m.i32_array("huge"), Err(GgufError::OutOfRange { .. })));
        assert!(matches!(m.bool("llama.block_count"), Err(GgufError::WrongType { .. })));
        // `_or` getters only default when the key is missing.
        assert!(matches!(m.u64_or("eps", 1), Err(GgufError::WrongType { .. })));
        assert!(matches!(m.f32_or("flag", 1.0), Err(GgufError::WrongType { .. })));
        assert!(matches!(m.bool_or("eps", true), Err(GgufError::WrongType { .. })));
    }

    #[test]
    fn value_conversions() {
        assert_eq!(Value::I8(-1).as_u64(), None);
        assert_eq!(Value::I8(-1).as_i64(), Some(-1));
        assert_eq!(Value::U64(u64::MAX).as_i64(), None);
        assert_eq!(Value::U64(u64::MAX).as_u64(), Some(u64::MAX));
        assert_eq!(Value::F64(0.25).as_f64(), Some(0.25));
        assert_eq!(Value::F32(0.25).as_u64(), None);
        assert_eq!(Value::Bool(true).as_f64(), None);
        assert_eq!(Value::Array(vec![]).type_name(), "array");
        assert_eq!(Value::String("x".into()).as_array(), None);
    }
}
