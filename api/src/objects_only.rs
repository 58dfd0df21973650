//! A struct is read from a JSON object only, never from an array.
//!
//! serde's derived struct visitors accept a sequence as the struct's fields in order, and
//! serde_json's `deserialize_struct` hands a JSON array to that path: without a guard,
//! `"stream_options": [true]` reads as `{"include_usage": true}` and a nine-element array as a
//! chat message. OpenAI and vLLM (pydantic: "Input should be a valid dictionary or object")
//! refuse such bodies with a 400 naming the field, and so does Switchyard: every request body
//! is read through [`ObjectsOnly`] (the crate's `body::parse_json` and `body::from_value`).
//!
//! [`ObjectsOnly`] wraps a `Deserializer` the way `serde_path_to_error` and `serde_ignored`
//! do: each visitor, sequence, map, enum and seed it hands on is wrapped too, so the values
//! nested at any depth stay under it. Its `deserialize_struct` (and a struct variant's
//! `struct_variant`) refuses a sequence with serde's own "invalid type: sequence, expected
//! struct X", which the body's errors tell as "invalid type: array, expected an object" at
//! the field's path. Every other value, a tuple or a `Vec` from an array included, reads as it
//! would without the wrapper.
//!
//! **Buffered values.** serde reads an untagged enum, an internally tagged enum and a
//! `#[serde(flatten)]` field by first buffering the value (serde's private `Content`) and then
//! deserializing the variant or the flattened struct from that buffer, with serde's own
//! deserializer, outside any wrapper. A struct reached that way is read through
//! [`objects_only`], named in the variant's or the field's `#[serde(deserialize_with)]`
//! (as `ContentField::Parts` and the chat and completion requests' flattened structured-output
//! and extra fields are; `IgnoredFields` reads only names and skips values, so needs none).
//!
//! ```
//! use serde::Deserialize;
//! use switchyard_api::objects_only::ObjectsOnly;
//!
//! #[derive(Deserialize)]
//! struct Point {
//!     x: i32,
//!     y: i32,
//! }
//!
//! // serde_json alone reads the array as the fields in order.
//! assert!(serde_json::from_str::<Point>("[1, 2]").is_ok());
//! let mut de = serde_json::Deserializer::from_str("[1, 2]");
//! let refused = Point::deserialize(ObjectsOnly(&mut de)).err().map(|e| e.to_string());
//! assert_eq!(
//!     refused.as_deref(),
//!     Some("invalid type: sequence, expected struct Point at line 1 column 1")
//! );
//! let mut de = serde_json::Deserializer::from_str(r#"{"x": 1, "y": 2}"#);
//! assert!(Point::deserialize(ObjectsOnly(&mut de)).is_ok());
//! // Arrays still read as lists and tuples.
//! let mut de = serde_json::Deserializer::from_str("[[1, 2]]");
//! assert!(Vec::<(i32, i32)>::deserialize(ObjectsOnly(&mut de)).is_ok());
//! ```

use std::fmt;

use serde::de::{
    DeserializeSeed, Deserializer, EnumAccess, Error as _, MapAccess, SeqAccess, Unexpected,
    VariantAccess, Visitor,
};
use serde::Deserialize;

/// A `Deserializer` under which every struct, at any depth, is read only from a map (a JSON
/// object); see the [module documentation](self).
pub struct ObjectsOnly<D>(pub D);

/// Reads `T` from `deserializer` with every struct in it read only from an object: the
/// `#[serde(deserialize_with = "objects_only")]` of a value serde buffers (an untagged or
/// internally tagged enum's variant, a flattened field) that is or holds a struct.
pub fn objects_only<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(ObjectsOnly(deserializer))
}

/// Forwards `deserialize_*` methods that take only a visitor, wrapping it.
macro_rules! forward {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
            self.0.$method(Nested::value(visitor))
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for ObjectsOnly<D> {
    type Error = D::Error;

    forward! {
        deserialize_any deserialize_bool deserialize_i8 deserialize_i16 deserialize_i32
        deserialize_i64 deserialize_i128 deserialize_u8 deserialize_u16 deserialize_u32
        deserialize_u64 deserialize_u128 deserialize_f32 deserialize_f64 deserialize_char
        deserialize_str deserialize_string deserialize_bytes deserialize_byte_buf
        deserialize_option deserialize_unit deserialize_seq deserialize_map
        deserialize_identifier deserialize_ignored_any
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.deserialize_unit_struct(name, Nested::value(visitor))
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0
            .deserialize_newtype_struct(name, Nested::value(visitor))
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.deserialize_tuple(len, Nested::value(visitor))
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0
            .deserialize_tuple_struct(name, len, Nested::value(visitor))
    }

    /// The one method that differs: a struct's visitor is refused a sequence.
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0
            .deserialize_struct(name, fields, Nested::structure(visitor))
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0
            .deserialize_enum(name, variants, Nested::value(visitor))
    }

    fn is_human_readable(&self) -> bool {
        self.0.is_human_readable()
    }
}

/// A visitor handed on by [`ObjectsOnly`]: what it is given is wrapped in turn; a struct's
/// (`structure`) refuses a sequence.
struct Nested<V> {
    /// The visitor wrapped.
    visitor: V,
    /// Whether it reads a struct, which only a map may stand for.
    structure: bool,
}

impl<V> Nested<V> {
    /// Wraps the visitor of any value but a struct.
    fn value(visitor: V) -> Self {
        Self {
            visitor,
            structure: false,
        }
    }

    /// Wraps a struct's visitor.
    fn structure(visitor: V) -> Self {
        Self {
            visitor,
            structure: true,
        }
    }
}

/// Forwards `visit_*` methods of one plain argument unchanged.
macro_rules! visit {
    ($($method:ident($ty:ty))*) => {$(
        fn $method<E: serde::de::Error>(self, v: $ty) -> Result<Self::Value, E> {
            self.visitor.$method(v)
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Nested<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.visitor.expecting(f)
    }

    visit! {
        visit_bool(bool) visit_i8(i8) visit_i16(i16) visit_i32(i32) visit_i64(i64)
        visit_i128(i128) visit_u8(u8) visit_u16(u16) visit_u32(u32) visit_u64(u64)
        visit_u128(u128) visit_f32(f32) visit_f64(f64) visit_char(char) visit_str(&str)
        visit_borrowed_str(&'de str) visit_string(String) visit_bytes(&[u8])
        visit_borrowed_bytes(&'de [u8]) visit_byte_buf(Vec<u8>)
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        self.visitor.visit_none()
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        self.visitor.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.visitor.visit_some(ObjectsOnly(d))
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.visitor.visit_newtype_struct(ObjectsOnly(d))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        if self.structure {
            // serde's words ("invalid type: sequence, expected struct X"), as it refuses a
            // map where a sequence belongs; the body's errors say them in JSON's.
            return Err(A::Error::invalid_type(Unexpected::Seq, &self.visitor));
        }
        self.visitor.visit_seq(Seq(seq))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        self.visitor.visit_map(Map(map))
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Self::Value, A::Error> {
        self.visitor.visit_enum(Enum(data))
    }
}

/// A seed whose deserializer is wrapped in [`ObjectsOnly`].
struct Seed<S>(S);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Seed<S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.deserialize(ObjectsOnly(d))
    }
}

/// A sequence whose elements are read under [`ObjectsOnly`].
struct Seq<A>(A);

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Seq<A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Self::Error> {
        self.0.next_element_seed(Seed(seed))
    }

    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

/// A map whose keys and values are read under [`ObjectsOnly`].
struct Map<A>(A);

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Map<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        self.0.next_key_seed(Seed(seed))
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.next_value_seed(Seed(seed))
    }

    fn next_entry_seed<K: DeserializeSeed<'de>, V: DeserializeSeed<'de>>(
        &mut self,
        kseed: K,
        vseed: V,
    ) -> Result<Option<(K::Value, V::Value)>, Self::Error> {
        self.0.next_entry_seed(Seed(kseed), Seed(vseed))
    }

    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

/// An enum whose variant name and content are read under [`ObjectsOnly`].
struct Enum<A>(A);

impl<'de, A: EnumAccess<'de>> EnumAccess<'de> for Enum<A> {
    type Error = A::Error;
    type Variant = Variant<A::Variant>;

    fn variant_seed<S: DeserializeSeed<'de>>(
        self,
        seed: S,
    ) -> Result<(S::Value, Self::Variant), Self::Error> {
        self.0
            .variant_seed(Seed(seed))
            .map(|(value, variant)| (value, Variant(variant)))
    }
}

/// A variant's content, read under [`ObjectsOnly`]; a struct variant only from a map.
struct Variant<A>(A);

impl<'de, A: VariantAccess<'de>> VariantAccess<'de> for Variant<A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), Self::Error> {
        self.0.unit_variant()
    }

    fn newtype_variant_seed<S: DeserializeSeed<'de>>(
        self,
        seed: S,
    ) -> Result<S::Value, Self::Error> {
        self.0.newtype_variant_seed(Seed(seed))
    }

    fn tuple_variant<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.tuple_variant(len, Nested::value(visitor))
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.struct_variant(fields, Nested::structure(visitor))
    }
}

#[cfg(test)]
#[path = "objects_only_tests.rs"]
mod tests;
