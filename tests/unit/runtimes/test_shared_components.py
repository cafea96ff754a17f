"""Shared components follow their holders into the host tier: offloaded when the
last holder on the device leaves, restored when one comes back or a new one
acquires it, freed with the last reference (wherever it is)."""

from __future__ import annotations

from harness.fake_models import FakeComponent
from tessera.runtimes.base import SharedComponents


class Freed(list[FakeComponent]):
    def __call__(self, component: FakeComponent) -> None:
        self.append(component)


def holders(num: int) -> tuple[SharedComponents, FakeComponent, Freed]:
    shared, freed = SharedComponents(), Freed()
    made = [shared.acquire("enc", lambda: (FakeComponent(500), 500), freed) for _ in range(num)]
    assert all(c is made[0] for c in made)
    return shared, made[0], freed


def test_the_component_moves_when_its_last_holder_on_the_device_parks() -> None:
    shared, component, freed = holders(2)
    assert shared.park("enc")
    assert not component.offloaded  # the other holder still runs on it
    assert shared.park("enc")
    assert component.offloaded
    shared.unpark("enc")
    assert not component.offloaded
    shared.release("enc")
    shared.release("enc", parked=True)
    assert freed == [component]
    assert shared.keys() == []


def test_a_new_holder_brings_a_parked_component_back() -> None:
    shared, component, _ = holders(1)
    shared.park("enc")
    again = shared.acquire("enc", lambda: (FakeComponent(1), 1))
    assert again is component
    assert not component.offloaded


def test_the_last_holder_on_the_device_unloading_offloads_it_for_the_parked_one() -> None:
    shared, component, freed = holders(2)
    shared.park("enc")
    shared.release("enc")  # unloaded, not parked: the other still waits in the tier
    assert component.offloaded
    assert freed == []
    shared.release("enc", parked=True)
    assert freed == [component]


def test_a_component_that_cannot_move_refuses_to_park() -> None:
    shared = SharedComponents()
    shared.acquire("plain", lambda: (object(), 10))
    assert not shared.park("plain")
    assert not shared.park("absent")
    shared.release("plain")
    assert shared.keys() == []
