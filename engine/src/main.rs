fn main() {
    println!("ember {}", env!("CARGO_PKG_VERSION"));
}
