"""Response formats of the size and shape real agents send: an assistant's tool set (issue tracker, code host,
calendar, mail, files, shell, web, payments), a nested deployment spec written inline, and a pydantic model's
schema; the grammar limits' defaults must let them all through."""
from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

TEXT = ('Free text as the user wrote it; keep the original language, wording and line breaks, and do not add '
        'anything the user did not ask for.')


def string(description: str = TEXT, **extra) -> dict:
    return {'type': 'string', 'description': description, **extra}


def obj(required: list[str], **properties) -> dict:
    return {'type': 'object', 'properties': properties, 'required': required, 'additionalProperties': False}


def array(items: dict, **extra) -> dict:
    return {'type': 'array', 'items': items, **extra}


def tool(name: str, description: str, parameters: dict) -> dict:
    return {'type': 'function', 'function': {'name': name, 'description': description, 'parameters': parameters}}


REPO = {'owner': string('The account owning the repository.', pattern='^[A-Za-z0-9-]{1,39}$'),
        'repo': string('The repository name, without the owner.', pattern='^[A-Za-z0-9._-]{1,100}$')}
SHA = string('A commit id: 7 to 40 lowercase hex digits.', pattern='^[0-9a-f]{7,40}$')
WHEN = {'dateTime': string('RFC 3339 timestamp.', format='date-time'),
        'timeZone': string('IANA time zone, e.g. Europe/Paris.')}
CURRENCIES = ['usd', 'eur', 'gbp', 'jpy', 'chf', 'cad', 'aud', 'nzd', 'sek', 'nok', 'dkk', 'pln', 'czk', 'huf', 'inr',
              'cny', 'hkd', 'sgd', 'krw', 'brl', 'mxn', 'zar', 'try', 'ils', 'aed', 'sar', 'thb', 'idr', 'myr', 'php']


def _tracker_tools() -> list[dict]:
    state = {'type': 'string', 'enum': ['open', 'closed', 'all']}
    labels = array(string('A label name.'), maxItems=20, uniqueItems=True)
    return [
        tool('create_issue', 'Open an issue in a repository.', obj(
            ['owner', 'repo', 'title'], **REPO, title=string(maxLength=256), body=string(),
            labels=labels, assignees=array(string('A login.'), maxItems=10),
            milestone={'type': ['integer', 'null'], 'minimum': 1})),
        tool('search_issues', 'Search issues and pull requests with the code host\'s query syntax.', obj(
            ['query'], query=string('Query, e.g. "is:open label:bug repo:o/r".', maxLength=256),
            sort={'type': 'string', 'enum': ['comments', 'reactions', 'created', 'updated', 'interactions']},
            order={'type': 'string', 'enum': ['asc', 'desc']}, state=state,
            per_page={'type': 'integer', 'minimum': 1, 'maximum': 100}, page={'type': 'integer', 'minimum': 1})),
        tool('create_pull_request', 'Open a pull request from head into base.', obj(
            ['owner', 'repo', 'title', 'head', 'base'], **REPO, title=string(), body=string(),
            head=string('Branch with the changes, or owner:branch.'), base=string('Branch to merge into.'),
            draft={'type': 'boolean'}, maintainer_can_modify={'type': 'boolean'})),
        tool('merge_pull_request', 'Merge a pull request.', obj(
            ['owner', 'repo', 'number'], **REPO, number={'type': 'integer', 'minimum': 1},
            merge_method={'type': 'string', 'enum': ['merge', 'squash', 'rebase']}, sha=SHA,
            commit_title=string(), commit_message=string())),
        tool('get_commit', 'Read one commit with its diff.', obj(['owner', 'repo', 'sha'], **REPO, sha=SHA)),
        tool('list_workflow_runs', 'List CI runs.', obj(
            ['owner', 'repo'], **REPO, branch=string('Branch name.'), created=string(format='date-time'),
            status={'type': 'string', 'enum': ['completed', 'action_required', 'cancelled', 'failure', 'neutral',
                                               'skipped', 'stale', 'success', 'timed_out', 'in_progress', 'queued',
                                               'requested', 'waiting', 'pending']})),
        tool('create_ticket', 'File a ticket in the project tracker.', obj(
            ['project', 'summary', 'issue_type'], project=string('Project key.', pattern='^[A-Z][A-Z0-9]{1,9}$'),
            summary=string(maxLength=255), description=string(),
            issue_type={'type': 'string', 'enum': ['Bug', 'Task', 'Story', 'Epic', 'Sub-task', 'Incident']},
            priority={'type': 'string', 'enum': ['Highest', 'High', 'Medium', 'Low', 'Lowest']},
            parent=string('Parent ticket key.', pattern='^[A-Z][A-Z0-9]{1,9}-[0-9]{1,7}$'),
            due_date=string(format='date'), story_points={'type': 'number', 'minimum': 0, 'maximum': 100},
            components=array(string('Component name.'), maxItems=10))),
    ]


def _office_tools() -> list[dict]:
    attendee = obj(['email'], email=string('Address.', format='email'), optional={'type': 'boolean'},
                   responseStatus={'type': 'string', 'enum': ['needsAction', 'declined', 'tentative', 'accepted']})
    reminder = obj(['method', 'minutes'], method={'type': 'string', 'enum': ['email', 'popup']},
                   minutes={'type': 'integer', 'minimum': 0, 'maximum': 40320})
    addresses = array(string('Address.', format='email'), maxItems=50)
    return [
        tool('create_event', 'Add an event to a calendar.', obj(
            ['summary', 'start', 'end'], calendar_id=string('Calendar id; "primary" for the user\'s own.'),
            summary=string(maxLength=1024), description=string(), location=string(),
            start=obj(['dateTime'], **WHEN), end=obj(['dateTime'], **WHEN),
            attendees=array(attendee, maxItems=100), recurrence=array(string('An RRULE line.'), maxItems=5),
            reminders=obj(['useDefault'], useDefault={'type': 'boolean'}, overrides=array(reminder, maxItems=5)),
            visibility={'type': 'string', 'enum': ['default', 'public', 'private', 'confidential']})),
        tool('send_email', 'Send an email from the user\'s account.', obj(
            ['to', 'subject', 'body'], to=addresses, cc=addresses, bcc=addresses, subject=string(maxLength=998),
            body=string(), html={'type': 'boolean'},
            attachments=array(obj(['filename', 'content_base64'], filename=string('File name.'),
                                  mime_type=string('MIME type.', pattern='^[a-z]+/[a-z0-9.+-]+$'),
                                  content_base64=string('The file, base64.')), maxItems=10))),
        tool('search_email', 'Search the mailbox.', obj(
            ['query'], query=string(), folder={'type': 'string', 'enum': ['inbox', 'sent', 'drafts', 'archive',
                                                                          'spam', 'trash']},
            after=string(format='date'), before=string(format='date'), limit={'type': 'integer', 'maximum': 200})),
        tool('create_payment', 'Charge a customer.', obj(
            ['amount', 'currency', 'customer'], amount={'type': 'integer', 'minimum': 50, 'description':
                                                        'In the smallest currency unit.'},
            currency={'type': 'string', 'enum': CURRENCIES},
            customer=string('Customer id.', pattern='^cus_[A-Za-z0-9]{14}$'),
            description=string(), metadata={'type': 'object', 'additionalProperties': {'type': 'string'},
                                            'maxProperties': 50},
            capture={'type': 'boolean'}, receipt_email=string(format='email'))),
    ]


def _workspace_tools() -> list[dict]:
    edit = obj(['old_text', 'new_text'], old_text=string('Text to replace, exactly as in the file.'),
               new_text=string('Its replacement.'))
    return [
        tool('read_file', 'Read a text file.', obj(['path'], path=string('Absolute path.'),
                                                   offset={'type': 'integer', 'minimum': 0},
                                                   limit={'type': 'integer', 'minimum': 1, 'maximum': 5000})),
        tool('write_file', 'Create or overwrite a file.', obj(['path', 'content'], path=string('Absolute path.'),
                                                              content=string())),
        tool('edit_file', 'Replace text in a file.', obj(['path', 'edits'], path=string('Absolute path.'),
                                                         edits=array(edit, minItems=1, maxItems=50),
                                                         dry_run={'type': 'boolean'})),
        tool('run_shell', 'Run a shell command in the workspace.', obj(
            ['command'], command=string('The command line.'), cwd=string('Working directory.'),
            timeout_ms={'type': 'integer', 'minimum': 1000, 'maximum': 600000}, background={'type': 'boolean'})),
        tool('web_search', 'Search the web.', obj(
            ['query'], query=string(maxLength=400), recency={'type': 'string', 'enum': ['day', 'week', 'month',
                                                                                        'year', 'any']},
            domains=array(string('A host name.'), maxItems=20), max_results={'type': 'integer', 'maximum': 20})),
        tool('fetch_url', 'Fetch a page as Markdown.', obj(['url'], url=string('The address.', format='uri'),
                                                           max_chars={'type': 'integer', 'maximum': 100000})),
    ]


def agent_tools() -> list[dict]:
    """About 50 tools, as an assistant wired to several services sends them with each request."""
    tools = _tracker_tools() + _office_tools() + _workspace_tools()
    copies = [tool(f'{t["function"]["name"]}_{site}', t['function']['description'] + f' ({site} account)',
                   t['function']['parameters']) for site in ('work', 'personal') for t in _tracker_tools()]
    return tools + copies


def _container(name_description: str) -> dict:
    key_ref = obj(['name', 'key'], name=string('Secret or config map.'), key=string('Key in it.'),
                  optional={'type': 'boolean'})
    probe = obj([], httpGet=obj(['port'], path=string('Path.'), port={'type': 'integer'},
                                httpHeaders=array(obj(['name', 'value'], name=string(), value=string()))),
                exec=obj(['command'], command=array(string('Argument.'))),
                initialDelaySeconds={'type': 'integer'}, periodSeconds={'type': 'integer'})
    quantity = {'type': 'object', 'additionalProperties': string('Quantity, e.g. 500m or 2Gi.',
                                                                 pattern='^[0-9]+(\\.[0-9]+)?(m|Ki|Mi|Gi|Ti)?$')}
    return obj(['name', 'image'], name=string(name_description, pattern='^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'),
               image=string('Image reference.'), args=array(string('Argument.')),
               env=array(obj(['name'], name=string('Variable.'), value=string('Value.'),
                             valueFrom=obj([], secretKeyRef=key_ref, configMapKeyRef=key_ref))),
               ports=array(obj(['containerPort'], containerPort={'type': 'integer', 'minimum': 1, 'maximum': 65535},
                               protocol={'type': 'string', 'enum': ['TCP', 'UDP', 'SCTP']})),
               resources=obj([], limits=quantity, requests=quantity), livenessProbe=probe, readinessProbe=probe)


def deployment() -> dict:
    """A deployment spec written inline (no $defs), nested as deep as such specs go."""
    labels = {'type': 'object', 'additionalProperties': string('Label value.', maxLength=63)}
    pod = obj(['containers'], containers=array(_container('Container name.'), minItems=1),
              initContainers=array(_container('Init container name.')),
              volumes=array(obj(['name'], name=string('Volume.'), configMap=obj(['name'], name=string('Map.')),
                                emptyDir=obj([], sizeLimit=string('Quantity.')))),
              nodeSelector=labels, serviceAccountName=string('Account.'))
    return obj(['apiVersion', 'kind', 'metadata', 'spec'], apiVersion={'const': 'apps/v1'},
               kind={'const': 'Deployment'}, metadata=obj(['name'], name=string('Name.'), labels=labels),
               spec=obj(['selector', 'template'], replicas={'type': 'integer', 'minimum': 0},
                        selector=obj(['matchLabels'], matchLabels=labels),
                        strategy=obj([], type={'enum': ['RollingUpdate', 'Recreate']},
                                     rollingUpdate=obj([], maxSurge={'type': ['integer', 'string']},
                                                       maxUnavailable={'type': ['integer', 'string']})),
                        template=obj(['spec'], metadata=obj([], labels=labels), spec=pod)))


class Address(BaseModel):
    street: str
    city: str
    postal_code: str = Field(pattern=r'^[0-9A-Z -]{3,10}$')
    country: str = Field(pattern='^[A-Z]{2}$', description='ISO 3166-1 alpha-2')


class LineItem(BaseModel):
    sku: str = Field(pattern='^[A-Z]{3}-[0-9]{4,8}$')
    description: str
    quantity: int = Field(ge=1, le=10000)
    unit_price: float = Field(ge=0)
    tax_rate: Literal[0, 5, 10, 20] = 20
    discount: float | None = None


class Invoice(BaseModel):
    number: str = Field(pattern='^INV-[0-9]{6}$')
    issued_at: datetime
    currency: Literal['EUR', 'USD', 'GBP', 'JPY']
    seller: Address
    buyer: Address
    shipping: Address | None = None
    items: list[LineItem] = Field(min_length=1, max_length=200)
    notes: list[str] = []
    status: Literal['draft', 'sent', 'paid', 'void'] = 'draft'


def invoice() -> dict:
    """pydantic's schema of a nested model ($defs, anyOf with null, Literal enums, patterns)."""
    return Invoice.model_json_schema()
