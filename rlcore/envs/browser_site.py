"""The small website the browser environment's tasks are done on: a shop and a contact form.

One HTTP server per process, on 127.0.0.1 and an ephemeral port, serves every episode's
site; each episode gets a fresh `Site` (its own in-memory SQLite database, seeded from the
episode's seed) under a path of its own, `/e/<token>/`, so what one rollout orders or
sends never shows in another, and the goal predicate reads the episode's own database.
The pages are plain server-rendered HTML forms (no JavaScript): home with a search box
and featured products, the product list, search results, a product page with a quantity
and "Add to cart", the cart, checkout (name, email, shipping), the order confirmation,
and a contact form. The footer links to a blog on another host, which the browser is
never allowed to reach.
"""

from __future__ import annotations

import html
import random
import secrets
import sqlite3
import threading
from dataclasses import dataclass
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

COLORS = ("red", "blue", "green", "black", "white", "yellow")
KINDS = ("mug", "teapot", "notebook", "lamp", "scarf", "backpack")
STYLES = ("ceramic", "classic", "tall", "tiny", "rustic", "modern", "glossy", "matte", "striped")
SHIPPING = ("standard", "express")
TOPICS = ("Order question", "Returns", "Other")
EXTERNAL_BLOG = "http://blog.example.com/"
NUM_PRODUCTS = 16
FEATURED = 3
MAX_FORM_BYTES = 20_000  # far more than any form here holds


@dataclass(frozen=True)
class Product:
    id: int
    name: str
    color: str
    kind: str
    price_cents: int
    stock: int

    @property
    def price(self) -> str:
        return f"${self.price_cents // 100}.{self.price_cents % 100:02d}"

    @property
    def price_decimal(self) -> Decimal:
        return Decimal(self.price_cents) / 100


def catalog(seed: int, color: str, kind: str) -> list[Product]:
    """The shop's products for `seed`: three of (`color`, `kind`) at distinct prices (so
    "the cheapest" has one answer), the rest of other color-kind pairs, every name
    distinct, in a seeded order."""
    rng = random.Random(seed)
    names: set[str] = set()
    rows: list[tuple[str, str, str]] = []
    while len(rows) < NUM_PRODUCTS:
        if len(rows) < 3:
            pair = (color, kind)
        else:
            pair = (rng.choice(COLORS), rng.choice(KINDS))
            if pair == (color, kind):
                continue
        name = f"{rng.choice(STYLES).capitalize()} {pair[0]} {pair[1]}"
        if name in names:
            continue
        names.add(name)
        rows.append((name, *pair))
    prices = rng.sample(range(300, 9900, 5), NUM_PRODUCTS)
    order = list(range(NUM_PRODUCTS))
    rng.shuffle(order)
    return [
        Product(
            id=position + 1,
            name=rows[index][0],
            color=rows[index][1],
            kind=rows[index][2],
            price_cents=prices[index],
            stock=rng.randint(2, 20),
        )
        for position, index in enumerate(order)
    ]


class Site:
    """One episode's shop: its products, cart, orders and contact messages in SQLite."""

    def __init__(self, products: list[Product]):
        self.products = {p.id: p for p in products}
        self.base = "/"  # the path it is served under; relative links resolve from it
        self.lock = threading.Lock()
        self.db = sqlite3.connect(":memory:", check_same_thread=False)
        self.db.executescript(
            """
            CREATE TABLE cart (product_id INTEGER PRIMARY KEY, quantity INTEGER NOT NULL);
            CREATE TABLE orders (id INTEGER PRIMARY KEY, name TEXT, email TEXT, shipping TEXT);
            CREATE TABLE order_lines (order_id INTEGER, product_id INTEGER, quantity INTEGER);
            CREATE TABLE messages (id INTEGER PRIMARY KEY, name TEXT, email TEXT, topic TEXT,
                                   body TEXT);
            """
        )

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # -- what the goal predicates read ---------------------------------------------------
    def orders(self) -> list[dict]:
        with self.lock:
            rows = self.db.execute("SELECT id, name, email, shipping FROM orders").fetchall()
            lines = self.db.execute("SELECT order_id, product_id, quantity FROM order_lines")
            by_order: dict[int, dict[int, int]] = {}
            for order_id, product_id, quantity in lines.fetchall():
                by_order.setdefault(order_id, {})[product_id] = quantity
        return [
            {"id": i, "name": n, "email": e, "shipping": s, "lines": by_order.get(i, {})}
            for i, n, e, s in rows
        ]

    def messages(self) -> list[dict]:
        with self.lock:
            rows = self.db.execute("SELECT name, email, topic, body FROM messages").fetchall()
        return [{"name": n, "email": e, "topic": t, "body": b} for n, e, t, b in rows]

    def cart(self) -> dict[int, int]:
        with self.lock:
            return dict(self.db.execute("SELECT product_id, quantity FROM cart").fetchall())

    # -- pages: each returns (status, html) or a redirect path -----------------------------
    def handle(self, method: str, path: str, query: dict, form: dict) -> tuple[int, str]:
        """(status, body) for one request; a 303's body is the path to go to."""
        if method == "POST":
            return self._post(path, form)
        if path == "/":
            return 200, self._home()
        if path == "/products":
            return 200, self._listing("All products", list(self.products.values()))
        if path == "/search":
            words = (query.get("q") or "").lower().split()
            found = [p for p in self.products.values() if all(w in p.name.lower() for w in words)]
            return 200, self._listing(f"Results for “{query.get('q', '')}”", found)
        if path.startswith("/product/") and path[9:].isdigit():
            product = self.products.get(int(path[9:]))
            if product is not None:
                return 200, self._product(product)
        if path == "/cart":
            return 200, self._cart()
        if path == "/checkout":
            return 200, self._checkout({}, "")
        if path.startswith("/order/") and path[7:].isdigit():
            return 200, self._order(int(path[7:]))
        if path == "/contact":
            return 200, self._contact("")
        return 404, self._page("Not found", "<p>There is no such page.</p>")

    def _post(self, path: str, form: dict) -> tuple[int, str]:
        if path == "/cart/add":
            product = self.products.get(_int(form.get("product"), 0))
            quantity = _int(form.get("quantity"), 0)
            if product is None or not 1 <= quantity <= product.stock:
                return 400, self._page("Cannot add", "<p>Pick a quantity in stock.</p>")
            with self.lock:
                self.db.execute(
                    "INSERT INTO cart VALUES (?, ?) ON CONFLICT(product_id) "
                    "DO UPDATE SET quantity = quantity + excluded.quantity",
                    (product.id, quantity),
                )
            return 303, "/cart"
        if path == "/cart/remove":
            with self.lock:
                self.db.execute(
                    "DELETE FROM cart WHERE product_id = ?", (_int(form.get("product"), 0),)
                )
            return 303, "/cart"
        if path == "/checkout":
            return self._place_order(form)
        if path == "/contact":
            name, email = form.get("name", "").strip(), form.get("email", "").strip()
            topic, body = form.get("topic", ""), form.get("message", "").strip()
            if not name or "@" not in email or topic not in TOPICS or not body:
                return 200, self._contact(
                    "Fill in your name, a valid email, a topic and a message."
                )
            with self.lock:
                self.db.execute(
                    "INSERT INTO messages (name, email, topic, body) VALUES (?, ?, ?, ?)",
                    (name, email, topic, body),
                )
            return 200, self._page(
                "Message sent", f"<p>Thank you, {_e(name)}. We will reply to {_e(email)}.</p>"
            )
        return 404, self._page("Not found", "<p>There is no such page.</p>")

    def _place_order(self, form: dict) -> tuple[int, str]:
        name, email = form.get("name", "").strip(), form.get("email", "").strip()
        shipping = form.get("shipping", "")
        cart = self.cart()
        if not cart:
            return 200, self._checkout(form, "Your cart is empty.")
        if not name or "@" not in email or shipping not in SHIPPING:
            return 200, self._checkout(form, "Fill in your name, a valid email and shipping.")
        with self.lock:
            cursor = self.db.execute(
                "INSERT INTO orders (name, email, shipping) VALUES (?, ?, ?)",
                (name, email, shipping),
            )
            order_id = cursor.lastrowid
            self.db.executemany(
                "INSERT INTO order_lines VALUES (?, ?, ?)",
                [(order_id, product, quantity) for product, quantity in cart.items()],
            )
            self.db.execute("DELETE FROM cart")
        return 303, f"/order/{order_id}"

    # -- HTML ----------------------------------------------------------------------------
    def _page(self, title: str, body: str) -> str:
        count = sum(self.cart().values())
        return (
            f"<!doctype html><html><head><meta charset='utf-8'><base href='{_e(self.base)}'>"
            f"<title>{_e(title)} · Mugshop"
            "</title><style>body{font:15px sans-serif;margin:16px;max-width:760px}"
            "nav a{margin-right:12px}li{margin:4px 0}input,textarea{margin:4px}"
            ".error{color:#b00}footer{margin-top:24px;color:#666}</style></head><body>"
            "<nav><a href='./'>Home</a><a href='products'>All products</a>"
            f"<a href='cart'>Cart ({count})</a><a href='contact'>Contact</a></nav>"
            f"<h1>{_e(title)}</h1>{body}"
            f"<footer><a href='{EXTERNAL_BLOG}'>Our blog</a></footer></body></html>"
        )

    def _search_form(self) -> str:
        return (
            "<form action='search' method='get'><input name='q' aria-label='Search products'>"
            "<button type='submit'>Search</button></form>"
        )

    def _product_list(self, products: list[Product]) -> str:
        if not products:
            return "<p>No products found.</p>"
        items = "".join(
            f"<li><a href='product/{p.id}'>{_e(p.name)}</a> {p.price}</li>" for p in products
        )
        return f"<ul>{items}</ul>"

    def _home(self) -> str:
        featured = sorted(self.products.values(), key=lambda p: p.id)[:FEATURED]
        return self._page(
            "Welcome to Mugshop",
            self._search_form() + "<h2>Featured</h2>" + self._product_list(featured),
        )

    def _listing(self, title: str, products: list[Product]) -> str:
        return self._page(title, self._search_form() + self._product_list(products))

    def _product(self, p: Product) -> str:
        return self._page(
            p.name,
            f"<p>Color: {p.color}</p><p>Price: {p.price}</p><p>In stock: {p.stock}</p>"
            "<form action='cart/add' method='post'>"
            f"<input type='hidden' name='product' value='{p.id}'>"
            "<label for='quantity'>Quantity</label>"
            f"<input id='quantity' name='quantity' type='number' value='1' min='1' max='{p.stock}'>"
            "<button type='submit'>Add to cart</button></form>",
        )

    def _cart(self) -> str:
        cart = self.cart()
        if not cart:
            return self._page("Your cart", "<p>Your cart is empty.</p>")
        rows, total = [], 0
        for product_id, quantity in cart.items():
            p = self.products[product_id]
            total += p.price_cents * quantity
            rows.append(
                f"<li>{_e(p.name)} × {quantity} "
                "<form action='cart/remove' method='post' style='display:inline'>"
                f"<input type='hidden' name='product' value='{p.id}'>"
                f"<button type='submit' aria-label='Remove {_e(p.name)}'>Remove</button></form></li>"
            )
        return self._page(
            "Your cart",
            f"<ul>{''.join(rows)}</ul><p>Total: ${total // 100}.{total % 100:02d}</p>"
            "<a href='checkout'>Checkout</a>",
        )

    def _checkout(self, form: dict, error: str) -> str:
        chosen = form.get("shipping", "standard")
        radios = "".join(
            f"<label><input type='radio' name='shipping' value='{s}'"
            f"{' checked' if s == chosen else ''}> {s.capitalize()} shipping</label>"
            for s in SHIPPING
        )
        return self._page(
            "Checkout",
            (f"<p class='error'>{_e(error)}</p>" if error else "")
            + "<form action='checkout' method='post'>"
            f"<p><label for='name'>Full name</label><input id='name' name='name' "
            f"value='{_e(form.get('name', ''))}'></p>"
            f"<p><label for='email'>Email</label><input id='email' name='email' "
            f"value='{_e(form.get('email', ''))}'></p>"
            f"<p>{radios}</p><button type='submit'>Place order</button></form>",
        )

    def _order(self, order_id: int) -> str:
        order = next((o for o in self.orders() if o["id"] == order_id), None)
        if order is None:
            return self._page("Not found", "<p>There is no such order.</p>")
        lines = "".join(
            f"<li>{_e(self.products[pid].name)} × {quantity}</li>"
            for pid, quantity in order["lines"].items()
        )
        return self._page(
            f"Order {order_id} placed",
            f"<p>Thank you, {_e(order['name'])}.</p><ul>{lines}</ul>"
            f"<p>{_e(order['shipping'].capitalize())} shipping to {_e(order['email'])}.</p>",
        )

    def _contact(self, error: str) -> str:
        topics = "".join(
            f"<label><input type='radio' name='topic' value='{_e(t)}'> {_e(t)}</label>"
            for t in TOPICS
        )
        return self._page(
            "Contact us",
            (f"<p class='error'>{_e(error)}</p>" if error else "")
            + "<form action='contact' method='post'>"
            "<p><label for='cname'>Your name</label><input id='cname' name='name'></p>"
            "<p><label for='cemail'>Your email</label><input id='cemail' name='email'></p>"
            f"<p>{topics}</p>"
            "<p><label for='cmessage'>Message</label><textarea id='cmessage' name='message'>"
            "</textarea></p><button type='submit'>Send message</button></form>",
        )


def _e(text: str) -> str:
    return html.escape(str(text), quote=True)


def _int(text: str | None, default: int) -> int:
    text = (text or "").strip()
    return int(text) if text.isdigit() and len(text) <= 6 else default


# ---------------------------------------------------------------------------------------
# The server


class _Handler(BaseHTTPRequestHandler):
    server: SiteServer

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        return None  # one line per request would drown a worker's log

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        parts = urlsplit(self.path)
        segments = parts.path.split("/", 3)  # "", "e", token, rest
        site = None
        if len(segments) >= 3 and segments[1] == "e":
            site = self.server.sites.get(segments[2])
        if site is None:
            self._send(404, "<p>No such site.</p>")
            return
        base = f"/e/{segments[2]}"
        path = "/" + (segments[3] if len(segments) > 3 else "")
        form: dict = {}
        if method == "POST":
            length = min(_int(self.headers.get("Content-Length"), 0), MAX_FORM_BYTES)
            form = _first_values(self.rfile.read(length).decode("utf-8", "replace"))
        try:
            status, body = site.handle(method, path, _first_values(parts.query), form)
        except sqlite3.ProgrammingError:  # the episode ended while its page was loading
            status, body = 410, "<p>This episode is over.</p>"
        if status == 303:
            self.send_response(303)
            self.send_header("Location", base + body)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._send(status, body)

    def _send(self, status: int, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _first_values(query: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(query, keep_blank_values=True).items()}


class SiteServer(ThreadingHTTPServer):
    """The process's server of every live episode's site, by token."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.sites: dict[str, Site] = {}
        threading.Thread(target=self.serve_forever, name="browser-site", daemon=True).start()

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def open(self, site: Site) -> str:
        """Serve `site`; returns its start URL."""
        token = secrets.token_hex(16)
        site.base = f"/e/{token}/"
        self.sites[token] = site
        return f"{self.origin}/e/{token}/"

    def close(self, url: str) -> None:
        site = self.sites.pop(url.rstrip("/").rsplit("/", 1)[-1], None)
        if site is not None:
            site.close()


_server: SiteServer | None = None
_server_lock = threading.Lock()


def site_server() -> SiteServer:
    """The process's site server, started on first use."""
    global _server
    with _server_lock:
        if _server is None:
            _server = SiteServer()
        return _server
